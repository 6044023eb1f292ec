"""The bottom layer: what every other layer uses, knowing no node, no profile and no step.

The errors, the events and the outcomes steps report, records and the state dir, files
written whole, waits and retries, the thread pool, redaction, outside data read into types,
the labels on what sparkdeploy starts, fingerprints, and what the package ships beside its code."""
