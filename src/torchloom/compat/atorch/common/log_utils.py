"""``atorch.common.log_utils.default_logger``: the compat layer's logger."""
import logging

default_logger = logging.getLogger("torchloom.compat.atorch")
