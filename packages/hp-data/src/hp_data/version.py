"""The version of hp-data, below every module that records it (`hp_data.__version__`)."""

__version__ = "0.1.0"
