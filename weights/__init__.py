"""The weight path, learner -> generators, in one package (docs/ARCHITECTURE.md,
"The walk of a weight set"). It is its own layer, above models/ and below generator/ and
learner/: both sides need it (the learner publishes, every generator receives, and they share
the digest, the blob layout and the record types), generator/ and learner/ never import each
other, and weight delivery is not model code. It imports proto and models only; models/ never
imports it. The publication, the digest, every transport and every receiver live here:

- digest.py: the digest (docs/CONTRACTS.md 6: the tree kind, and the flat kind of older runs), the
  blob layout and its one decoder (``state_from_blob``);
- publication.py: ``Publication`` (the one place a publication's digest is computed),
  manifest.json, RUN_DIR/weights/v<N> and its pruning;
- verified.py: ``VerifiedWeights`` (the one "verified weights" type), ``OnDisk``,
  ``verify_blob`` and the generator loop's ``WeightSink`` protocol;
- chunked.py: the ZeroMQ chunk stream (transport zmq; shared_fs is its announce alone), both
  ends, with the per-piece digest check;
- collective.py, collective_learner.py, collective_generator.py: transport collective (a
  torch.distributed broadcast), its helpers and its two ends.

The learner's own part (the TP gather and the cast) is learner/publish.py.
"""
