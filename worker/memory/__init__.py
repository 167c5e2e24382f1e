"""What fits on the card: the device and its profiles' decisions, the rung table and ladder,
measured peaks, the partial rung's split, and the faults that drill them."""
