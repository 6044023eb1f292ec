"""Stand-ins for the engines and services the lab replaces (stdlib-only modules)."""
