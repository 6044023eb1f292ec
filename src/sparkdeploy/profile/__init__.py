"""The deployment profile: its schema and validation (``config``), the files it extends
(``overlays``), the recipes and their catalog."""
