"""The parallel forms: each takes a model (or its parts) and explicit arguments, never the CLI's config."""
