"""Imported first by `import fitone`: tqdm.auto, imported once here without its Jupyter warning.

In a Jupyter kernel without ipywidgets, the first import of tqdm.auto (transformers and fitone both use
it) warns "IProgress not found" and falls back to the text bar, which works: nothing for a user to act
on. The module is cached, so later imports do not warn again. The user's own warning filters are untouched.
"""

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="IProgress not found")
    import tqdm.auto  # noqa: F401
