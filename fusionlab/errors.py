"""Exceptions that carry a message meant for the user."""


class UserError(Exception):
    """Bad input from the user: reported as one line, exit code 2."""


class RegistrationError(UserError):
    """An op or variant was registered with invalid data."""
