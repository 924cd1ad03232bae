"""The removal's losses: the objective and each auxiliary term it adds."""
