"""AES-256-GCM sealing for encrypted collections and the transaction log (SPEC S10, T4).

A *sealed* blob is ``nonce (12 bytes) || ciphertext || tag (16 bytes)``, so it is
always exactly :data:`OVERHEAD` (28) bytes longer than the plaintext.  Every call
to :meth:`Sealer.seal` draws a fresh random 96-bit nonce from ``os.urandom``;
nothing is derived from a counter, so a crash can never make a nonce repeat.
(NIST SP 800-38D bounds random 96-bit nonces at 2**32 seals per key; a
collection that writes more records than that under one key should be
re-keyed.)

The *additional authenticated data* (AAD) binds a blob to its context.  Callers
pass whatever identifies the slot the blob belongs in (the Bitcask engine uses
the collection's salt, a field tag and the record's gsn), so a sealed blob cut
from one record and pasted into another fails its tag.

The key check value is the seal of a fixed constant under a fixed AAD.  It is
stored in a collection's meta file; :meth:`Sealer.verify` opens it and raises
:class:`~armdb.errors.WrongKey` when the tag fails, which is how a wrong key is
refused at open, before any record is read.
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .errors import ConfigError, CorruptionError, WrongKey

__all__ = ["KEY_CHECK_LEN", "KEY_LEN", "NONCE_LEN", "OVERHEAD", "TAG_LEN", "Sealer"]

KEY_LEN = 32
NONCE_LEN = 12
TAG_LEN = 16
OVERHEAD = NONCE_LEN + TAG_LEN

_CHECK_PLAIN = b"armdb key check value, v1 \x00\x01\x02\x03"
_CHECK_AAD = b"armdb.kcv"
KEY_CHECK_LEN = OVERHEAD + len(_CHECK_PLAIN)  # the length of a key check value (58)


class Sealer:
    """Seal and open byte strings with one AES-256-GCM key.

    Parameters
    ----------
    key : bytes
        The 32-byte AES-256 key.

    Raises
    ------
    ConfigError
        If ``key`` is not 32 bytes.
    """

    __slots__ = ("_aead",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_LEN:
            raise ConfigError(f"encryption key must be {KEY_LEN} bytes (an AES-256 key), e.g. os.urandom(32)")
        self._aead = AESGCM(bytes(key))

    def seal(self, plain: bytes, aad: bytes = b"") -> bytes:
        """Encrypt and authenticate ``plain`` under a fresh random nonce.

        Parameters
        ----------
        plain : bytes
            The plaintext (may be empty).
        aad : bytes, optional
            Additional data that is authenticated but not stored; the same bytes
            must be passed to :meth:`open`.

        Returns
        -------
        bytes
            ``nonce || ciphertext || tag``, ``len(plain) + OVERHEAD`` bytes long.
        """
        nonce = os.urandom(NONCE_LEN)
        return nonce + self._aead.encrypt(nonce, plain, aad)

    def open(self, sealed: bytes | memoryview, aad: bytes = b"", *, what: str = "sealed data") -> bytes:
        """Check the tag of a sealed blob and return its plaintext.

        Parameters
        ----------
        sealed : bytes or memoryview
            A blob produced by :meth:`seal`.
        aad : bytes, optional
            The additional data given to :meth:`seal`.
        what : str, optional
            Where the blob came from (file and offset), used in the error message.

        Returns
        -------
        bytes
            The plaintext.

        Raises
        ------
        CorruptionError
            If the blob is too short or its authentication tag does not match
            (the bytes were changed, or belong to another record).
        """
        if len(sealed) < OVERHEAD:
            raise CorruptionError(
                f"{what}: sealed field of {len(sealed)} bytes is shorter than nonce+tag ({OVERHEAD}); "
                f"the file is damaged, restore it from a backup"
            )
        blob = bytes(sealed)
        try:
            return self._aead.decrypt(blob[:NONCE_LEN], blob[NONCE_LEN:], aad)
        except InvalidTag:
            raise CorruptionError(
                f"{what}: AES-GCM authentication tag check failed (the bytes were altered or moved); "
                f"the file is damaged, restore it from a backup"
            ) from None

    def key_check(self) -> bytes:
        """Return a fresh key check value to store beside the data.

        Returns
        -------
        bytes
            The seal of a fixed constant under a fixed AAD.
        """
        return self.seal(_CHECK_PLAIN, _CHECK_AAD)

    def verify(self, check: bytes) -> None:
        """Check that this key produced the key check value ``check``.

        Parameters
        ----------
        check : bytes
            A value returned by :meth:`key_check` (possibly under another key).

        Raises
        ------
        WrongKey
            If ``check`` does not open under this key.
        """
        try:
            plain = self.open(check, _CHECK_AAD, what="key check value")
        except CorruptionError:
            plain = b""
        if plain != _CHECK_PLAIN:
            raise WrongKey(
                "the encryption key does not match the key this collection was created with; "
                "open it with the original key"
            )
