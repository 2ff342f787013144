"""What the model stages (calibrate, validate) share: device and dtype choice, checkpoint pairing checks,
held-out/calibration sample sets, and report artifacts (JSON, Markdown, figures). Stages import from here,
never from each other."""
