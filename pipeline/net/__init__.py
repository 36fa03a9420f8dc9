"""Networking and weight transfer: the session protocol, its ZeroMQ and in-memory transports, CURVE security, weight publication and delivery."""
