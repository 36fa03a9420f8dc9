"""The torch generator engine: the reference forward (`models.engine.chunk`) behind the generator loop,
without vLLM (`engine.py`: TorchEngine), with its requests, tick decode and weight loading."""
