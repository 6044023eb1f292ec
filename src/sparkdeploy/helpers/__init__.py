"""The node-side helpers: standard library only, staged on a node (or into a container) as
files and run there by its python3; the controller never imports them. Found through
``sparkdeploy.core.packaged``."""
