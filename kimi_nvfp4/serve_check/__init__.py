"""serve_check."""
