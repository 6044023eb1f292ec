"""A model's arithmetic, pure (no node, no hub): does it fit (``fit``, ``model.fit``'s
decision), the fit calculator on its config.json (``estimate``), which files are its weights
(``weights``)."""
