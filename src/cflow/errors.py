"""The root of cflow's named errors. Every error a user can cause derives from CflowError and
says what is wrong and what to do about it."""


class CflowError(Exception):
    """Base class of every error cflow raises on bad input."""
