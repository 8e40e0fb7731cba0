"""The trainer (builds everything from the config and runs the loop) and the train step."""
