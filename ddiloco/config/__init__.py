"""The run configuration: every section, its checks, overrides, recipes and the JSON schema."""
