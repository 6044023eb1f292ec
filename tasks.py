"""Root invoke collection: wiring only. Every namespace lives in src/sparkdeploy/tasks/."""

from sparkdeploy.tasks import ns  # noqa: F401  (invoke looks for `ns`)
