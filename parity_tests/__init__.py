"""torch_impl vs reference: the only package that imports both sides (STYLE.md, Tests)."""
