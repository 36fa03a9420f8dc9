"""looprl wire protocol: typed records (`records.py`, their schema `schema.py`, arrays `tensors.py`,
the column-wise RolloutBatch `batch.py`), the codec (`codec.py`: msgpack + zstd framing), the
protocol version (`version.py`), the one `ProtocolError` (`errors.py`) and stream files
(`stream/`)."""
