"""AWS Neuron (Inferentia, Trainium): devices or NeuronCores from the driver's sysfs tree; no vendor library."""

from kxpu.backends.neuron.backend import NeuronBackend, NeuronConfig

__all__ = ["NeuronBackend", "NeuronConfig"]
