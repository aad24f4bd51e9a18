"""CPU kernels and the rules around them: the one capability probe (cpu.py), the kernels'
environment variables (settings.py), backend choice (choice.py), weight alignment
(alignment.py) and the guarded private torch operator (int8pack.py)."""
from server.model.kernels.alignment import (
                                         ALIGNMENT,
                                         align_module,
                                         aligned,
                                         is_aligned,
                                         misaligned,
)
from server.model.kernels.choice import (
                                         BackendUnavailable,
                                         forced_int8_backend,
                                         half_backend,
                                         int8_candidates,
)
from server.model.kernels.cpu import CPU_CLASSES, CpuCaps, cpu_caps
from server.model.kernels.settings import (
                                         HALF_ENV,
                                         INT8_ENV,
                                         KERNEL_CACHE_ENV,
                                         KERNEL_ENV,
                                         KernelSettingError,
                                         KernelSettings,
                                         kernel_settings,
)

__all__ = ["ALIGNMENT", "BackendUnavailable", "CPU_CLASSES", "CpuCaps", "KernelSettingError",
           "KernelSettings", "align_module", "aligned", "cpu_caps", "forced_int8_backend",
           "half_backend", "int8_candidates", "is_aligned", "kernel_settings", "misaligned",
           "HALF_ENV", "INT8_ENV", "KERNEL_CACHE_ENV", "KERNEL_ENV"]
