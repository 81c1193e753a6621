"""Where programs run: the in-kernel runtime (`LocalBackend`) or an API endpoint."""
