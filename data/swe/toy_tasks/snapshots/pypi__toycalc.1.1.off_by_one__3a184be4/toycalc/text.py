"""Small text helpers."""


def count_words(text):
  return len([w for w in text.split() if w])


def slugify(text, sep="-"):
  words = [w.lower() for w in text.split() if w.isalnum()]
  return sep.join(words)


def truncate(text, width, suffix="..."):
  if len(text) <= width:
    return text
  keep = width - len(suffix)
  return text[:keep] + suffix


def is_palindrome(text):
  letters = [c.lower() for c in text if c.isalnum()]
  return letters == letters[::-1] and len(letters) > 0
