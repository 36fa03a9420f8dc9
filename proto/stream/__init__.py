"""Rollout stream files: what the recorder writes (every accepted rollout) and replay reads.

A stream is a directory of append-only segment files with sidecar indexes (layout in
:mod:`proto.stream.format`; the writer and ``recover`` in :mod:`proto.stream.writer`, the
reader in :mod:`proto.stream.reader`, salvage in :mod:`proto.stream.salvage`). Each frame
holds one opaque payload (an encoded, compressed proto message) under a strictly increasing
sequence number.

Order of calls::

    with StreamWriter(path, segment_bytes=64 << 20, fsync="batch") as w:   # one writer
        seq = w.append(payload)        # buffered; assigns seq (or checks the given one)
        w.flush()                      # now visible to readers (and fsync'd unless "never")

    with StreamReader(path) as r:      # any number of readers, other processes included
        r.get(seq); r.iter(start_seq=0); r.iter(follow=True, timeout=5.0)  # tail a live stream

Crash safety: frames are only appended; a writer killed at any moment leaves at most one
torn frame at the tail of the last segment. Readers stop before it without changing
anything; ``StreamWriter`` (on open) and ``recover`` truncate it and repair the index.
Damage anywhere else raises ``StreamCorruptError`` naming the segment and offset;
``recover`` checks every frame and salvages the intact ones around it
(:mod:`proto.stream.salvage`), keeping the original files in a backup directory.
"""
