"""The weight path, learner -> generators, in one package (docs/ARCHITECTURE.md, "The walk of
a weight set"). Its own layer, above models/ and below generator/ and learner/: both sides
need it, generator/ and learner/ never import each other, and weight delivery is not model
code. It imports proto and models only; models/ never imports it.

The interface (a transport is a learner-side publisher and a generator-side receiver,
registered by name in ``weights.transports.TRANSPORTS``; a new one is its module plus one line
there)::

    # learner (the coordinator, pipeline.core)
    deliveries = DeliveryLog()                                   # weights.deliveries
    publisher = open_publisher(transport, deliveries.endpoint(endpoint), settings, run_dir)
    pending = PublicationQueue(max_pending)                      # weights.pending
    pending.submit(Snapshot(v, lambda: publisher.prepare(finish())))   # beside the next step
    for pub, stages in pending.ready():                          # a weights.publication.Publication
        publisher.publish(pub)                                   # the announce, then the transfer
    publisher.add_generator / handle / observe / remove_generator / pump / close
    deliveries.delivered(generator_id, claimed_version)          # a claim checked

    # generator (generator.loop, then the engine's own thread)
    receiver = open_receiver(conn, generator_id, serving_version=engine.weight_version)
    weights = receiver.handle(record)             # every record of the weights channel
    engine.load_weights(weights)                  # a VerifiedWeights: weights.state() is checked
    receiver.loaded(weights.version)              # or receiver.load_failed(version, why)

Files:

- digest.py: the digest (docs/CONTRACTS.md 6: the tree kind, and the flat kind of older runs),
  the blob layout and its one decoder (``state_from_blob``);
- publication.py: ``Publication`` (the one place a publication's digest is computed),
  manifest.json, RUN_DIR/weights/v<N> and its pruning;
- pending.py: publications finished off the critical path (``PublicationQueue``);
- transports.py: the registry, ``open_publisher`` and ``open_receiver``;
- publisher.py: ``WeightPublisher``, the learner's end of the weights channel (every transport's
  announce, and the zmq chunk stream);
- receiver.py: ``WeightReceiver``, the generator's end (announced directories, the chunk stream);
- shm.py: transport shm (a /dev/shm copy per host), both ends;
- cuda_ipc.py: transport cuda_ipc (the blob in the learner's device buffers, copied and checked
  on the device by the generators on its host), both ends; device_digest.py its digest kind;
- collective/: transport collective (a torch.distributed broadcast): group.py its helpers,
  learner.py and generator.py its two ends;
- check.py: where a received set's digest is checked, and ``WeightsRefused``, the one error
  of a refused set;
- verified.py: ``VerifiedWeights``, the one type a receiver hands the engine;
- deliveries.py: ``DeliveryLog``, the versions announced to each generator.

The learner's own part (the TP gather and the cast) is learner/publish.py.
"""
