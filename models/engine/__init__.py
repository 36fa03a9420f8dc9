"""The reference looped engine in pure PyTorch: the KV cache per (iteration, layer) and the chunk
forward (`chunk.py`, the spec's forward), the sync-free fixed-depth decode step and its CUDA graph
(`graph.py`), decode by ticks (`ticks.py`; on CUDA at one shape, `tickgraph.py`, deciding exits
on the device with `tickdecide.py` and writing K/V with `kv.py`), and the Triton decode attention
(`attention.py`)."""
