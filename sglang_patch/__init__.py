"""Everything that touches SGLang: plugin entry point, cache backend, scheduler hooks, attention, launcher.

Kept import-light on purpose: `kernel_guard` is imported from a .pth file at every interpreter start-up.
"""
