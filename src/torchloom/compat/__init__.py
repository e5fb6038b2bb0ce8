"""Drop-in compatibility layers for other libraries' APIs (``torchloom.compat.atorch``: docs/compat_atorch.md)."""
