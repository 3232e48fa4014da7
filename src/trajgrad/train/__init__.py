"""Training loops, critic, checkpoints and logging (imports the core, never the reverse).

The modules the command line calls load on first attribute access (PEP 562,
``trajgrad.train.run``, ...), as does ``trajgrad.train`` itself from ``trajgrad``.
"""
from .._lazy import lazy_attributes as _lazy_attributes

# attribute -> submodule (the command line's entry points)
_LAZY = {
    "config": "config",
    "config_reference": "config_reference",
    "config_sources": "config_sources",
    "doctor": "doctor",
    "doctor_report": "doctor_report",
    "mixture": "mixture",
    "run": "run",
}


__getattr__ = _lazy_attributes(__name__, _LAZY)
