"""demo_model."""
