/* CRC-32 (IEEE, zlib's) by carry-less multiplication: the folding method of Intel's
 * "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ Instruction" (Gopal et
 * al., 2009), with the bit-reflected constants given at its end (the same ones Linux's
 * crc32-pclmul and Chromium's zlib use).
 *
 * armdb_crc_clmul(crc, p, n) is the raw update of armdb._core.fixed._crc_update (no
 * pre- or post-inversion) over the first n & ~15 bytes of p, n >= 16; the caller runs the
 * byte tables over the rest.  armdb_clmul_ok() says whether this CPU has the instruction
 * (checked once, at run time: the module is built for the baseline x86-64).  Elsewhere
 * (another CPU family, another compiler) armdb_clmul_ok() is 0 and the tables do it all.
 */
#ifndef ARMDB_CRC_CLMUL_H
#define ARMDB_CRC_CLMUL_H

#include <stddef.h>
#include <stdint.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define ARMDB_HAVE_CLMUL 1
#include <immintrin.h>

static int armdb_clmul_ok(void) {
    static int ok = -1;
    if (ok < 0) {
        __builtin_cpu_init();
        ok = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse2");
    }
    return ok;
}

__attribute__((target("pclmul,sse2")))
static uint32_t armdb_crc_clmul(uint32_t crc, const uint8_t *buf, size_t len) {
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596LL, 0x0154442bd4LL);
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL);
    const __m128i k5k0 = _mm_set_epi64x(0, 0x0163cd6124LL);
    const __m128i poly = _mm_set_epi64x(0x01f7011641LL, 0x01db710641LL);
    const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);
    __m128i x0, x1, x2, x3, x4, x5, x6, x7, x8;

    if (len >= 64) {
        /* Four lanes of 16 bytes, folded 64 bytes at a time. */
        x1 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)buf), _mm_cvtsi32_si128((int)crc));
        x2 = _mm_loadu_si128((const __m128i *)(buf + 16));
        x3 = _mm_loadu_si128((const __m128i *)(buf + 32));
        x4 = _mm_loadu_si128((const __m128i *)(buf + 48));
        buf += 64;
        len -= 64;
        while (len >= 64) {
            x5 = _mm_clmulepi64_si128(x1, k1k2, 0x00);
            x6 = _mm_clmulepi64_si128(x2, k1k2, 0x00);
            x7 = _mm_clmulepi64_si128(x3, k1k2, 0x00);
            x8 = _mm_clmulepi64_si128(x4, k1k2, 0x00);
            x1 = _mm_clmulepi64_si128(x1, k1k2, 0x11);
            x2 = _mm_clmulepi64_si128(x2, k1k2, 0x11);
            x3 = _mm_clmulepi64_si128(x3, k1k2, 0x11);
            x4 = _mm_clmulepi64_si128(x4, k1k2, 0x11);
            x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), _mm_loadu_si128((const __m128i *)buf));
            x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), _mm_loadu_si128((const __m128i *)(buf + 16)));
            x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), _mm_loadu_si128((const __m128i *)(buf + 32)));
            x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), _mm_loadu_si128((const __m128i *)(buf + 48)));
            buf += 64;
            len -= 64;
        }
        /* The four lanes into one. */
        x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
        x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
        x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);
    } else {
        x1 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)buf), _mm_cvtsi32_si128((int)crc));
        buf += 16;
        len -= 16;
    }
    /* One lane, 16 bytes at a time. */
    while (len >= 16) {
        x5 = _mm_clmulepi64_si128(x1, k3k4, 0x00);
        x1 = _mm_clmulepi64_si128(x1, k3k4, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, _mm_loadu_si128((const __m128i *)buf)), x5);
        buf += 16;
        len -= 16;
    }
    /* 128 bits to 64. */
    x2 = _mm_clmulepi64_si128(x1, k3k4, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, mask32);
    x1 = _mm_clmulepi64_si128(x1, k5k0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    /* Barrett reduction to 32 bits. */
    x2 = _mm_and_si128(x1, mask32);
    x2 = _mm_clmulepi64_si128(x2, poly, 0x10);
    x2 = _mm_and_si128(x2, mask32);
    x2 = _mm_clmulepi64_si128(x2, poly, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_cvtsi128_si32(_mm_srli_si128(x1, 4));
}

#else
#define ARMDB_HAVE_CLMUL 0
static int armdb_clmul_ok(void) { return 0; }
static uint32_t armdb_crc_clmul(uint32_t crc, const uint8_t *buf, size_t len) {
    (void)buf; (void)len;
    return crc;  /* never called: armdb_clmul_ok() is 0 */
}
#endif

#endif
