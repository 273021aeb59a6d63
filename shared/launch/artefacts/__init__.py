"""What a trained run leaves to use outside training: its greedy policy exported as a standalone
file, packaged to publish, or played against in the terminal."""
