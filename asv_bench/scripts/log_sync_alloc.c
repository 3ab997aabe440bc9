/* What an fdatasync costs beside appends, by how the file was allocated (round 15 of
 * docs/performance.md: why armdb allocates a log file ahead at its first durable commit).
 *
 * One thread appends 120-byte records 20 us apart (20,000 of them); another calls
 * fdatasync on the same descriptor in a loop.  Prints the appends' latency percentiles
 * and the mean time a sync took.  Run it in the folder whose file system you want to
 * measure (it writes ./log_sync_alloc.dat):
 *
 *   gcc -O2 -pthread asv_bench/scripts/log_sync_alloc.c -o /tmp/log_sync_alloc
 *   for mode in 0 1 2 3 4; do /tmp/log_sync_alloc $mode 1; done
 *
 * mode: 0 the file grows with each append (armdb before round 15), 1 4 MiB of zeros
 * written first, 2 posix_fallocate of 4 MiB (what armdb does), 3 fallocate with
 * FALLOC_FL_KEEP_SIZE (blocks, but the size still grows), 4 FALLOC_FL_ZERO_RANGE.
 * The second argument: 1 runs the syncing thread, 0 times the appends alone.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/falloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int fd;
static volatile int stop = 0;
static long syncs = 0;

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void *syncer(void *arg) {
    (void)arg;
    while (!stop) {
        fdatasync(fd);
        syncs++;
    }
    return NULL;
}

static int cmp(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODE(0-4) WITH_SYNC(0|1)\n", argv[0]);
        return 2;
    }
    int mode = atoi(argv[1]), with_sync = atoi(argv[2]);
    const long long ahead = 4 << 20;
    fd = open("log_sync_alloc.dat", O_CREAT | O_TRUNC | O_RDWR, 0644);
    if (fd < 0) {
        perror("open");
        return 1;
    }
    if (mode == 1) {
        char zeros[65536];
        memset(zeros, 0, sizeof zeros);
        for (long long off = 0; off < ahead; off += sizeof zeros)
            if (pwrite(fd, zeros, sizeof zeros, off) != (ssize_t)sizeof zeros) perror("pwrite");
    } else if (mode == 2) {
        posix_fallocate(fd, 0, ahead);
    } else if (mode == 3) {
        fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, ahead);
    } else if (mode == 4) {
        fallocate(fd, FALLOC_FL_ZERO_RANGE, 0, ahead);
    }
    fsync(fd);
    pthread_t t;
    if (with_sync) pthread_create(&t, NULL, syncer, NULL);
    enum { N = 20000 };
    long long *lat = malloc(N * sizeof *lat);
    char rec[120];
    memset(rec, 7, sizeof rec);
    long long t0 = now_ns();
    for (int i = 0; i < N; i++) {
        long long a = now_ns();
        if (pwrite(fd, rec, sizeof rec, (long long)i * sizeof rec) != (ssize_t)sizeof rec) perror("pwrite");
        lat[i] = now_ns() - a;
        long long b = now_ns();
        while (now_ns() - b < 20000) {
        }
    }
    long long elapsed = now_ns() - t0;
    stop = 1;
    if (with_sync) pthread_join(t, NULL);
    qsort(lat, N, sizeof *lat, cmp);
    printf("mode %d sync %d: append p50 %lld p90 %lld p99 %lld max %lld ns; %ld syncs in %.2f s = %.0f us a sync\n",
           mode, with_sync, lat[N / 2], lat[N * 9 / 10], lat[N * 99 / 100], lat[N - 1], syncs, elapsed / 1e9,
           syncs ? elapsed / 1e3 / syncs : 0.0);
    close(fd);
    unlink("log_sync_alloc.dat");
    return 0;
}
