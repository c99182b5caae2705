"""Every version-dependent seam with vLLM, speculators and Ray Train, one module per seam.

See compat/README.md for the inventory (version ranges, upstream issues, removal
conditions). Nothing outside compat/ touches vLLM or speculators internals.
Importing this package imports neither vllm nor torch; each seam imports lazily.
"""
