"""The two channels between the learner (rank 0) and its generators (docs/PROTOCOL.md): the
session protocol over them (`session.py`: Hello/Welcome, heartbeats, flow control; the
`LearnerEndpoint` and `GeneratorConnection` interfaces), its settings, counters and errors
(`config.py`), and its two implementations, ZeroMQ sockets (`zmq.py`) and the in-memory fake
that drives the fast tests (`memory.py`)."""
