"""The nodes as the controller reaches them: ``Host.run`` (``hosts``), node helpers run and
staged (``nodeops``), what a run knows of them (``facts``), the deployment every step gets, the
fast link, their memory, discovery and the profile it writes, the fan-out planner and the
served endpoint."""
