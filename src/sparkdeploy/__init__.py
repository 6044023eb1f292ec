"""sparkdeploy: serve one large model across DGX Spark nodes, one resumable step at a time."""

__version__ = "0.1.0"
