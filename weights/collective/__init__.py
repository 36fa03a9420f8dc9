"""Transport collective: a version as a torch.distributed broadcast from the learner to the
generators that joined its group (gloo on any host, nccl between CUDA devices), ZMQ chunks for
a generator that falls out of it. `group.py`: the TCPStore, the group, the pipelined delivery
of a blob in pieces; `learner.py`: the publisher (rounds of a version); `generator.py`: the
receiver (joins, receives, checks)."""
