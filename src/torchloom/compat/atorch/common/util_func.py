"""``atorch.common.util_func``: ``data_to_device`` (the same function as ``atorch.data.data_to_device``)."""
from ..data import data_to_device  # noqa: F401
