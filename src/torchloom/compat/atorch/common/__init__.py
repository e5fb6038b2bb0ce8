"""``atorch.common``: the helpers ATorch's tests and examples import from it."""
