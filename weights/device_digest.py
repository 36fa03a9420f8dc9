"""The device digest of a weight blob (docs/CONTRACTS.md 6, kind ``mix128``): computed where the
blob is, on the GPU, in one read of its bytes, by the same-host transport (weights.cuda_ipc).

The sha256 tree digest (weights.digest) is what every version is named by and what replay
compares; it is computed on the host, over the host blob. A version that travels from the
learner's GPU to a generator's GPU on one host is checked on the device instead, with this
digest of the same canonical bytes (the blob layout of weights.digest):

    words    the blob as little-endian uint32 words, the last one padded with zero bytes
    x_j      = w_j XOR (j * 0x9E3779B97F4A7C15 mod 2^64)        (j: the word's index)
    lane A   = sum_j a(x_j) mod 2^64, a = the splitmix64 finalizer (shifts 30, 27, 31)
    lane B   = sum_j b(x_j) mod 2^64, b = the murmur3 fmix64 finalizer (shifts 33, 33, 33)
    digest   = sha256 hex of b"looprl-weights-mix128/1\\0" + total bytes (8 bytes LE)
               + the header leaf (weights.digest.blob_head: names, dtypes, shapes, sizes)
               + lane A (8 bytes LE) + lane B (8 bytes LE)

Each word is mixed with its position by a bijection, and the lanes are sums, so the blocks
of a blob are summed in any order (one program per block on the GPU) and a moved, changed
or torn word changes both lanes with probability 1 - 2^-128 for errors that do not target
it. It guards against corruption and torn reads of the learner's own memory on the same host;
it is not a cryptographic hash (the tree digest is, for what crosses hosts or disks).

``device_digest`` runs a Triton kernel on a CUDA tensor (``INTERPRET`` lets tests run it on
the CPU under TRITON_INTERPRET=1); ``reference_digest`` is the same definition in numpy, the
spec the kernel is tested against (tests/weights/test_device_digest.py).
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from weights.digest import blob_head, canonical_flat

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover  (no Triton: reference_digest only)
    triton = None  # type: ignore[assignment]

KIND = "mix128"
"""The digest kind a record names (the announce's cuda_ipc field, weights/digests.jsonl)."""
_TAG = b"looprl-weights-mix128/1\0"
_GOLD = 0x9E3779B97F4A7C15
_A1, _A2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finalizer
_B1, _B2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # murmur3's fmix64
_M64 = (1 << 64) - 1
BLOCK = 4096
"""Words per program of the kernel (16 KiB of the blob)."""
INTERPRET = [False]
"""Tests: take the kernel on CPU tensors too (under TRITON_INTERPRET=1)."""

__all__ = ["BLOCK", "INTERPRET", "KIND", "Lanes", "device_digest", "digest_on_host_blob", "lanes_digest", "padded_size",
           "reference_digest", "reference_lanes"]  # fmt: skip


def padded_size(nbytes: int) -> int:
    """Bytes of a buffer that holds an ``nbytes`` blob as whole uint32 words."""
    return -(-nbytes // 4) * 4


def lanes_digest(total: int, meta: Sequence[Any], a: int, b: int) -> str:
    """The digest of a blob of ``total`` bytes, tensors ``meta``, from its two lane sums."""
    head = blob_head(total, meta)
    body = _TAG + struct.pack("<Q", total) + head + struct.pack("<QQ", a & _M64, b & _M64)
    return hashlib.sha256(body).hexdigest()


def reference_lanes(
    blob: bytes | bytearray | memoryview, piece_words: int = 1 << 22, first_word: int = 0
) -> tuple[int, int]:
    """(lane A, lane B) of ``blob`` (module docstring), in numpy (uint64 arithmetic wraps);
    ``first_word``: the blob's first word is word ``first_word`` of a longer one (its index
    mixes with that position)."""
    view = memoryview(blob).cast("B")
    n = len(view)
    a = b = np.uint64(0)
    words = padded_size(n) // 4
    with np.errstate(over="ignore"):
        for lo in range(0, words, piece_words):
            hi = min(lo + piece_words, words)
            raw = bytes(view[lo * 4 : min(hi * 4, n)])
            raw += b"\0" * ((hi - lo) * 4 - len(raw))
            w = np.frombuffer(raw, dtype="<u4").astype(np.uint64)
            j = np.arange(first_word + lo, first_word + hi, dtype=np.uint64)
            x = w ^ (j * np.uint64(_GOLD))
            xa = x ^ (x >> np.uint64(30))
            xa = xa * np.uint64(_A1)
            xa ^= xa >> np.uint64(27)
            xa = xa * np.uint64(_A2)
            xa ^= xa >> np.uint64(31)
            xb = x ^ (x >> np.uint64(33))
            xb = xb * np.uint64(_B1)
            xb ^= xb >> np.uint64(33)
            xb = xb * np.uint64(_B2)
            xb ^= xb >> np.uint64(33)
            a = a + np.add.reduce(xa, dtype=np.uint64)
            b = b + np.add.reduce(xb, dtype=np.uint64)
    return int(a), int(b)


def reference_digest(blob: bytes | bytearray | memoryview, meta: Sequence[Any]) -> str:
    """The digest of ``blob`` with tensors ``meta`` (the spec: numpy, on the host)."""
    return lanes_digest(len(memoryview(blob).cast("B")), meta, *reference_lanes(blob))


if triton is not None:

    @triton.jit
    def _lanes_kernel(W, Out, n_words, j0, gold, a1, a2, b1, b2, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = j < n_words
        w = tl.load(W + j, mask=m, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        x = w ^ ((j + j0).to(tl.uint64) * gold)
        xa = x ^ (x >> 30)
        xa = xa * a1
        xa = xa ^ (xa >> 27)
        xa = xa * a2
        xa = xa ^ (xa >> 31)
        xb = x ^ (x >> 33)
        xb = xb * b1
        xb = xb ^ (xb >> 33)
        xb = xb * b2
        xb = xb ^ (xb >> 33)
        zero = tl.zeros([BLOCK], tl.uint64)
        tl.store(Out + 2 * pid, tl.sum(tl.where(m, xa, zero), 0))
        tl.store(Out + 2 * pid + 1, tl.sum(tl.where(m, xb, zero), 0))


def _kernel_ok(buf: torch.Tensor) -> bool:
    return triton is not None and (buf.is_cuda or INTERPRET[0])


def device_lanes(buf: torch.Tensor, nbytes: int) -> tuple[int, int]:
    """(lane A, lane B) of the first ``nbytes`` of ``buf`` (a contiguous uint8 tensor of at
    least ``padded_size(nbytes)`` bytes whose bytes past ``nbytes`` are zero), on its device:
    one read of the blob, one partial pair per ``BLOCK`` words, summed on the host (wrapping)."""
    lanes = Lanes()
    lanes.add_words(buf, nbytes)
    return lanes.total()


class Lanes:
    """The two lane sums of one blob fed in order, piece by piece, where its tensors are (the
    blob need not exist as one buffer): ``feed`` a tensor's canonical bytes, or
    ``add_words`` a buffer of whole words; ``total`` the lanes. Pieces that do not end on a
    word boundary pass through a staging buffer of ``staging`` bytes, so every word is
    mixed with its index in the blob, as ``device_lanes`` over the packed blob mixes it.
    On a CUDA tensor (or under ``INTERPRET``) the kernel runs and its partial sums stay on
    the device until ``total``; elsewhere the numpy spec."""

    def __init__(self, staging: int = 1 << 24) -> None:
        self.words = 0  # words summed so far (the next one's index)
        self.nbytes = 0  # bytes fed
        self._a = self._b = 0
        self._parts: list[torch.Tensor] = []
        self._stage: torch.Tensor | None = None
        self._fill = 0
        self._staging = max(4 * BLOCK, staging // (4 * BLOCK) * 4 * BLOCK)

    def feed(self, t: torch.Tensor) -> None:
        """A tensor's canonical bytes (C order), next in the blob."""
        raw = canonical_flat(t)
        if raw is None:
            return
        n, off = raw.numel(), 0
        self.nbytes += n
        while off < n:
            whole = (n - off) // 4 * 4
            if self._fill == 0 and whole and (raw.data_ptr() + off) % 4 == 0:
                self._words(raw[off : off + whole], whole)
                off += whole
                continue
            stage = self._staged(raw)
            take = min(stage.numel() - self._fill, n - off)
            stage[self._fill : self._fill + take].copy_(raw[off : off + take])
            self._fill += take
            off += take
            if self._fill == stage.numel():
                self._words(stage, self._fill)
                self._fill = 0

    def add_words(self, buf: torch.Tensor, nbytes: int) -> None:
        """The first ``nbytes`` of ``buf`` (``device_lanes``' conditions), next in the blob;
        only as the blob's last piece when ``nbytes`` is not a multiple of 4."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError(
                f"a flat contiguous uint8 buffer expected, got {buf.dtype} {tuple(buf.shape)}"
            )
        if buf.numel() < padded_size(nbytes):
            raise ValueError(
                f"a buffer of {buf.numel()} bytes holds no {nbytes}-byte blob as words"
            )
        if self._fill or self.nbytes % 4:
            raise ValueError("add_words after a piece that did not end on a word boundary")
        self.nbytes += nbytes
        if nbytes:
            self._words(buf, nbytes)

    def total(self) -> tuple[int, int]:
        """(lane A, lane B) of everything fed (the last partial word padded with zeros)."""
        if self._fill:
            stage = self._stage
            assert stage is not None
            end = padded_size(self._fill)
            stage[self._fill : end].zero_()
            self._words(stage, self._fill)
            self._fill = 0
        a, b = self._a, self._b
        if self._parts:
            parts = torch.cat([p.cpu() for p in self._parts]).numpy().view(np.uint64)
            with np.errstate(over="ignore"):
                pa, pb = np.add.reduce(parts.reshape(-1, 2), axis=0, dtype=np.uint64)
            a, b = a + int(pa), b + int(pb)
        return a & _M64, b & _M64

    def _staged(self, like: torch.Tensor) -> torch.Tensor:
        if self._stage is None or self._stage.device != like.device:
            self._stage = torch.zeros(self._staging, dtype=torch.uint8, device=like.device)
        return self._stage

    def _words(self, buf: torch.Tensor, nbytes: int) -> None:
        """Sum the words of ``buf[:padded_size(nbytes)]`` as words ``self.words``... ."""
        size = padded_size(nbytes)
        n = size // 4
        if not _kernel_ok(buf):
            a, b = reference_lanes(buf[:nbytes].cpu().numpy().tobytes(), first_word=self.words)
            self._a, self._b = self._a + a, self._b + b
        else:
            words = buf[:size].view(torch.int32)
            grid = max(1, -(-n // BLOCK))
            out = torch.empty(2 * grid, dtype=torch.int64, device=buf.device)
            _lanes_kernel[(grid,)](words, out, n, self.words, _GOLD, _A1, _A2, _B1, _B2,
                                   BLOCK=BLOCK)  # fmt: skip
            self._parts.append(out)
        self.words += n


def digest_on_host_blob(blob: bytes | bytearray | memoryview, meta: Sequence[Any]) -> str:
    """The digest of a host ``blob``: on this process's CUDA card when there is one (copied
    there, one kernel: a 7 GB set in well under a second, where the numpy spec reads ~0.2
    GB/s), else ``reference_digest``. Replay and a resume check a device-named version so."""
    view = memoryview(blob).cast("B")
    n = len(view)
    if not n or triton is None or not torch.cuda.is_available():
        return reference_digest(view, meta)
    buf = torch.zeros(padded_size(n), dtype=torch.uint8, device="cuda")
    with warnings.catch_warnings():  # a read-only blob: torch warns, and only reads it here
        warnings.simplefilter("ignore", UserWarning)
        src = torch.frombuffer(view, dtype=torch.uint8)
    buf[:n].copy_(src)
    return device_digest(buf, n, meta)


def device_digest(buf: torch.Tensor, nbytes: int, meta: Sequence[Any]) -> str:
    """The digest of the blob in the first ``nbytes`` of ``buf`` with tensors ``meta``
    (``device_lanes``' conditions on ``buf``), computed on its device."""
    return lanes_digest(nbytes, meta, *device_lanes(buf, nbytes))
