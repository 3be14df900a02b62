"""A backend module whose import fails with something other than ImportError (loaded with --import)."""

raise RuntimeError("vendor library refused to initialise: no licence server")
