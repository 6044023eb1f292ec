"""Data the package ships: the seed profile and the transformers Dockerfile (``sparkdeploy.core.packaged``)."""
