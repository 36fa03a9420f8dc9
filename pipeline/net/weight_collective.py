"""Moved to models.weights.collective_learner (issue 20: the weight path is one package); this
name stays for the importers outside that package until they import it from there."""

from models.weights.collective_learner import CollectivePublisher, make_publisher

__all__ = ["CollectivePublisher", "make_publisher"]
