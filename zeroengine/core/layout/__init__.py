"""The partition math, the flat groups and how parameters are laid into them; where values land at
initialize()."""
