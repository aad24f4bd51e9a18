"""MTP serving daemon for DeepSeek-V3/R1-style models."""
import warnings

# torch tries numpy while it imports and, when numpy is absent, warns "Failed to
# initialize NumPy" (torch/_subclasses/functional_tensor.py). The server never converts
# tensors to numpy, so numpy is not a dependency (only the test extra has it) and the
# warning would only alarm operators on every start. This package is imported before any
# of its modules imports torch, also in the worker processes (and first in their fork
# server: engine/child.py), so one filter here covers them all. Only that message from
# torch is silenced.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning,
                        module=r"torch\.")
