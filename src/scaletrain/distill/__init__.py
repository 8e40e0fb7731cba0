"""Knowledge distillation (technique 7): a small student learns from a large frozen teacher.

teacher.py finds, verifies and runs the teacher; student.py wraps the student with its
projections, maps and initialises its layers; losses.py holds the losses (soft-target KL,
hidden-state and attention MSE, cosine), objective.py combines them into one loss the train
step calls; cache.py writes and reads the teacher-output cache; evaluate.py scores encoders;
build.py wires it from the config.
"""
