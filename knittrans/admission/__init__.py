"""Admission: which completed trajectories the trainer consumes, one mini-batch (optimizer step) at a time."""

from knittrans.admission.base import AdmissionError, AdmissionPolicy, AdmissionStats, BatchLedger
from knittrans.admission.feasibility import Solution, Unit, Verdict, check_plan, solve
from knittrans.admission.minibatch import KnitTransAdmission

__all__ = ["AdmissionError", "AdmissionPolicy", "AdmissionStats", "BatchLedger", "KnitTransAdmission", "Solution",
           "Unit", "Verdict", "check_plan", "solve"]
