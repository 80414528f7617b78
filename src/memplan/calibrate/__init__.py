"""Calibration: fit the residuals of verify rows into a small file that `estimate --calibration FILE` applies.

- fit: the pure model (Calibration, fit, apply; one bounded factor per peak phase class).
- files: verify rows in, the calibration file out and back in (every bad input an InputError).
- command: `memplan calibrate`.

The shipped model meets the accuracy bar without a calibration; estimates are uncalibrated unless asked.
"""
