"""Engine tests run tiny models: one intra-op thread is fastest (a second thread only adds
synchronisation, and on a shared 2-core machine its spin-waits slow every step badly)."""
import torch

torch.set_num_threads(1)
