from toycalc import text


def test_count_words():
  assert text.count_words("a b  c") == 3


def test_slugify():
  assert text.slugify("Hello Big World") == "hello-big-world"


def test_slugify_sep():
  assert text.slugify("a b", sep="_") == "a_b"


def test_truncate_short():
  assert text.truncate("abc", 5) == "abc"


def test_truncate_long():
  assert text.truncate("abcdefgh", 6) == "abc..."


def test_palindrome():
  assert text.is_palindrome("Never odd or even")
  assert not text.is_palindrome("abc")
  assert not text.is_palindrome("")
