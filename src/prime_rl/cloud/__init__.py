"""SkyPilot and dstack tasks of an RL run (`rl --cloud...`): tasks.py."""
