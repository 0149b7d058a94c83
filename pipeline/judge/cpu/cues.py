"""Lexical cues of a user's reply: praise, complaint or correction, holding on, asking, irony.

The fine-tuned encoder (:mod:`pipeline.judge.cpu.finetune`) learns most of a reply's stance from
the training rows; these counts are extra inputs of the classifier head (:func:`cue_vector`), and
three of them move the models' decision (:meth:`pipeline.judge.cpu.classifier.NextStateClassifier.judge_user`):
irony markers next to praise, a complaining clause after a contrast ("thanks, but ...", "aber",
"mais", "但是", "でも"), and cues pointing against the models' sign. Each group of patterns was
kept because it earns rows on the left-out labelled sets (``bench/judge_loso.py --single-rules``,
docs/judge.md "What each rule earns"); what earned none was deleted, and so were the words and
phrases that occur in no reply the judge learns from or is measured on. The word lists are our own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


def _words(*alts: str) -> re.Pattern:
    """Alternatives matched as whole words (letters of any script around them break a match)."""
    return re.compile(r"(?<![\w])(?:" + "|".join(alts) + r")(?![\w])", re.I)


def _chars(*alts: str) -> re.Pattern:
    """Alternatives matched anywhere (scripts without spaces between words)."""
    return re.compile("|".join(alts))


_POSITIVE_EN = _words(
    r"thanks?", r"thank you", r"thx", r"ty", r"cheers", r"appreciated?", r"grateful", r"perfect(?:ly)?", r"great",
    r"awesome", r"excellent", r"brilliant", r"fantastic", r"wonderful", r"amazing", r"lovely", r"beautiful(?:ly)?",
    r"sweet", r"neat", r"cool", r"nice(?:ly)?", r"good job", r"well done", r"nice work",
    r"love(?:d|s)? (?:it|this|that)", r"love", r"exactly", r"precisely", r"spot on", r"nailed it", r"that'?s it",
    r"that'?s the one", r"correct", r"right on", r"that'?s right", r"you'?re right", r"yes", r"yep", r"yup", r"yeah",
    r"ya", r"works", r"worked", r"working (?:now|again|fine|great|perfectly)", r"runs", r"compiles", r"passes",
    r"passed", r"(?:is |all |back to )green", r"green again", r"fixed", r"solved", r"resolved", r"sorted",
    r"did the trick", r"helps", r"helped", r"helpful", r"useful", r"clear", r"makes sense", r"made sense", r"lgtm",
    r"looks good", r"sounds good", r"looks great", r"sounds great", r"good", r"fine",
    r"ok(?:ay)? (?:great|perfect|cool|thanks)", r"lifesaver", r"the best", r"clever", r"smart", r"agreed", r"matches",
    r"checks out", r"confirmed", r"ta", r"merci", r"danke", r"gracias", r"grazie", r"obrigad[oa]", r"much better",
    r"haha+", r"finally", r"incredible", r"wow", r"huge", r"true", r"got it (?:working|running|to work)", r"^done\b",
    r"[\w-]+ it is[!.]*$", r"went through", r"came through", r"(?:has |have )?arrived",
    r"got (?:a|an|the|my) (?:[\w-]+ )?(?:invite|invitation|offer|confirmation|refund|job|approval|reply)",
    r"next(?: one| question| step| task| up)?:", r"^clean[.!]", r"(?:very|so|nice and|super) clean",
    r"(?:much|way|so much|a lot|far) (?:better|clearer|nicer|cleaner|faster|more (?:readable|diplomatic|natural|"
    r"professional|polished|concise))",
    r"sent it", r"(?:it'?s |been )?sent(?=[.!]*$)",
    r"i (?:really |especially |do |quite |just |absolutely )?(?:like|liked|love|loved|enjoy(?:ed)?|adore)",
    r"you'?re (?:a |the )?(?:star|legend|hero|genius|gem|champ|best)",
    r"(?:good|great|nice) (?:call|catch|idea|pick|point)", r"going with (?:it|this|that)",
    r"(?:i'?ll|we'?ll|gonna) (?:use|take|go with) (?:it|this|that)",
    r"(?:i'?m |i'?ll |we'?ll |we'?re |going to |gonna )(?:print|send|ship|merge|post|use|using|printing|sending|"
    r"shipping|merging|posting) (?:it|this|that|them)",
    r"that'?s (?:great|perfect|awesome|lovely|helpful|brilliant)")
_POSITIVE_OTHER = _words(
    r"ja", r"oui", r"sí", r"да",
    # de
    r"danke(?: schön| sehr| dir)?", r"viel besser", r"vielen dank", r"perfekt", r"super", r"klasse", r"genau",
    r"stimmt", r"richtig", r"funktioniert", r"klappt", r"passt",
    # fr
    r"merci(?: beaucoup)?", r"parfait", r"génial", r"exactement", r"ça marche", r"ça fonctionne", r"fonctionne",
    r"nickel", r"impeccable", r"top", r"bravo", r"excellent", r"c'?est (?:ça|bon|juste|correct)", r"mignon", r"adorer",
    r"bien vu",
    # es / pt / it
    r"gracias", r"muchas gracias", r"perfecto", r"genial", r"exacto", r"correcto", r"funciona", r"funcionó",
    r"excelente", r"muy bien", r"vale", r"buenísimo", r"grazie(?: mille)?", r"perfetto", r"esatto", r"ottimo",
    r"bravo", r"obrigad[oa]", r"perfeito", r"correto", r"funcionou", r"ótimo", r"valeu", r"deu certo", r"certo",
    # nl / sv / pl / tr
    r"bedankt", r"dank je(?: wel)?", r"klopt", r"werkt", r"top", r"tack", r"fungerar", r"dzięki", r"idealnie",
    r"działa", r"super", r"teşekkür(?:ler| ederim)?", r"mükemmel", r"doğru", r"çalıştı",
    # ru
    r"спасибо", r"отлично", r"идеально", r"верно", r"работает", r"точно")
_POSITIVE_CJK = _chars(
    r"谢谢", r"多谢", r"完美", r"对了", r"可以了", r"好的", r"没问题", r"太好了", r"成功", r"解决了", r"运行正常", r"就是这个", r"ありがとう", r"完璧",
    r"正しい", r"動きました", r"助かり", r"감사", r"고마워", r"완벽", r"맞아", r"잘 돼", r"좋아요", r"네", r"👍", r"🙏", r"✔", r"👏", r"😂", r"🎉",
    r"✅", r"👌", r"❤", r"😍", r"🙌", r"💯", r"😄")

_NEGATIVE_EN = _words(
    r"no", r"nope", r"nah", r"wrong(?:ly)?", r"incorrect", r"false", r"mistakes?", r"typos?", r"errors?",
    r"exceptions?", r"fails?", r"failed", r"failure", r"broken", r"broke", r"bugs?", r"crash(?:es|ed|ing)?", r"hangs?",
    r"segfaults?", r"worse", r"slower", r"useless", r"nonsense", r"terrible", r"meh", r"ugh+", r"seriously",
    r"come on", r"misunderst(?:ood|and)", r"missed", r"missing", r"forgot", r"forgotten", r"ignored?", r"skipped",
    r"left out", r"made (?:it|that) up", r"doesn'?t exist", r"outdated", r"deprecated", r"off by",
    r"too (?:long|short|wordy|verbose|formal|casual|informal|technical|simple|complex|complicated|vague|generic|"
    r"much|many|few|little|slow|big|small|basic|advanced|dense|stiff|cheesy|bland|boring|repetitive)",
    r"way too", r"shorter", r"longer",
    r"(?<!what )(?<!how )i (?:said|asked|meant|told you|wanted|specified|mentioned|needed)", r"i already",
    r"not what i", r"that'?s not", r"that is not", r"this is not", r"this isn'?t", r"absolutely not",
    r"definitely not", r"never (?:received|got|arrived|came|showed up|worked|loaded|answered)",
    r"(?:hasn'?t|haven'?t|didn'?t|has not|have not|did not) (?:arrived|received|come|got|gotten|shown up|changed)",
    r"(?:nobody|no one|nothing) (?:can|could|works?|worked|loads?|happens|happened|changed|shows?|showed)",
    r"(?:is|are|was|were|looks|seems) (?:off|wrong|incorrect|broken|missing|empty)",
    r"you (?:left|put) (?:out|in|half|the|a|it)", r"you still", r"^(?:almost|nearly|close)\b[.!,]",
    r"i (?:don'?t|do not|can'?t|cannot) (?:see|find)",
    r"^(?:it'?s|it is|should be|actually) (?!right|correct|true|fine|great|perfect|good|ok|okay|it|done)"
    r"[\w.,'-]+[.!]?$",
    r"^[\w.,'-]+\*$", r"(?<=[,;]) ?(?:pas|nicht|no|non|não|не|nie)\s+[\w'-]+", r"ich wollte", r"je voulais",
    r"eu queria", r"volevo", r"try again", r"redo", r"re-?do",
    r"(?:do|write|say|check|read|explain|answer|run|look|fix) (?:it |that |this |them )?again",
    r"(?:wrong|broken|failing|failed|crash\w*|errors?|stuck|empty) again", r"again\?",
    r"something'?s (?:off|wrong|not right|missing|broken)",
    r"(?:exits?|quits?|dies|closes) (?:right away|immediately)",
    r"(?:returns?|returning|got|getting|gives?|giving|throws?|throwing|shows?|showing|prints?|printing) "
    r"(?:a |an |me )?(?:[45]\d\d|errors?|exceptions?|null|none|nan|undefined|nothing|garbage|zeros?|empty|blank)",
    r"(?<=[,;]) ?not (?:a |an |the )?[\w'-]+", r"(?:should|needs? to|has to|must) be", r"that was the first thing",
    r"already (?:tried|did|done|said|told|checked|asked|mentioned)", r"(?:even|still) (?:worse|slower|more)",
    r"one more time", r"rewrite", r"re-?write", r"fix (?:it|this|that|the)", r"please fix",
    r"should (?:be|have|say|read)", r"supposed to", r"actually,? it'?s", r"backwards", r"the opposite",
    r"still (?:not|doesn'?t|does not|broken|crash\w*|fail\w*|wrong|the same|getting|get|gives|can'?t|won'?t|no|red|"
    r"there|missing|hasn'?t|isn'?t|shows?|happen\w*|see|too|has|have|seeing|empty|slow|off)",
    r"same (?:error|problem|issue|thing|mistake|result|output|answer)",
    r"not (?:quite|really|exactly|right|correct|working|helpful|useful|good|great|it|what|the)",
    r"you (?:didn'?t|did not|haven'?t|have not|forgot|missed|ignored|skipped|keep|changed|deleted|removed|broke)",
    r"(?:doesn'?t|does not|didn'?t|did not|don'?t|won'?t|can'?t|cannot|isn'?t|wasn'?t|aren'?t) "
    r"(?:even |really |actually |always |quite )?(?:work|run|compile|load|open|start|help|answer|match|build|"
    r"install|print|render|make sense|fit|rhyme|"
    r"change|do anything|exist)\w*",
    r"drop (?:the|it)", r"remove (?:the|it|that)", r"change (?:the|it|this|that)",
    r"make it (?:shorter|longer|simpler|more|less|sound|rhyme|formal|casual|\w+er)", r"don'?t use",
    r"no (?:emojis?|bullet points?|jargon|more)", r"why (?:did|would) you", r"are you (?:sure|kidding)",
    r"did you (?:even )?read", r"thanks for nothing", r"read (?:my|the) question", r"wall of text")
_NEGATIVE_OTHER = _words(
    # de
    r"nein", r"falsch", r"stimmt nicht", r"funktioniert nicht", r"fehler", r"nochmal", r"zu lang", r"nicht gefragt",
    r"immer noch", r"viel zu",
    # fr
    r"non", r"faux", r"incorrect", r"ne marche pas", r"marche pas", r"erreur", r"encore",
    r"trop (?:long|court|compliqué|formel)", r"beaucoup trop", r"je voulais dire", r"ce n'?est pas", r"pas ce que",
    r"toujours la même",
    # es / pt / it
    r"mal", r"incorrecto", r"no funciona", r"sigue sin", r"otra vez", r"demasiado", r"no es", r"eso no", r"sbagliato",
    r"non funziona", r"errore", r"troppo", r"non è", r"errado", r"não funciona", r"erro", r"ainda", r"não é",
    r"muito longo",
    # nl / sv / pl / tr
    r"não", r"nee", r"werkt niet", r"klopt niet", r"fel", r"źle", r"nie działa", r"yanlış", r"çalışmıyor",
    # ru
    r"нет", r"неправильно", r"не работает", r"ошибка", r"опять", r"слишком",
    # "still broken", "I said / asked for X", "please correct": the same kinds in other languages
    r"immer noch nicht", r"bitte (?:korrigieren|ändern|anpassen)", r"korrigier\w*", r"toujours pas",
    r"j'?avais (?:dit|demandé|précisé)", r"j'?ai (?:dit|demandé|précisé)", r"sigue (?:igual|fallando|dando)",
    r"(?:te|lo) dije", r"(?:yo )?ped[íi]", r"corr[ií]gelo", r"ho chiesto", r"eu (?:disse|pedi)", r"nog steeds",
    r"ik (?:zei|vroeg|had gezegd|had gevraagd)", r"pas (?:dat|het|dit) (?:even )?aan", r"nadal", r"przecież",
    r"prosił(?:em|am)", r"mówił(?:em|am)", r"всё ещё", r"я (?:же )?(?:просил[а]?|писал[а]?|говорил[а]?)", r"hâlâ")
_NEGATIVE_CJK = _chars(
    r"不对", r"错了", r"错误", r"不行", r"不是", r"还是", r"太长", r"报错", r"不能", r"いいえ", r"違います", r"動かない", r"動きません", r"エラー", r"長すぎ",
    r"틀렸", r"아니", r"안 돼", r"오류", r"다시", r"太短", r"我要的是", r"我说的是", r"还是不", r"まだ同じ", r"まだエラー", r"壊れ", r"ましたよね", r"無理です",
    r"잘못", r"아직도", r"아니라", r"🙄", r"😞", r"😭", r"🤦")


_RELATIVE = re.compile(r"\b(?:what|which|whatever|if|whether) (?:was|is|were|gets?|got|has been|it) $", re.I)
_IGNORE = _words(r"no way", r"no idea", r"no clue", r"no rush")
_SARCASM = _words(  # irony markers: praise next to them is not trusted
    r"oh (?:great|perfect|wonderful|brilliant|fantastic|joy|lovely|sure|awesome)",
    r"(?:great|perfect|wonderful|brilliant|fantastic|lovely|awesome|amazing|excellent|super),? (?:just|now|another|so)",
    r"ah yes,? the", r"the famous", r"groundbreaking", r"sure it (?:is|does|will|works)", r"yeah,? sure",
    r"because that'?s", r"just what i (?:needed|wanted|asked for)", r"thanks for nothing",
    r"sure,? (?:fine|thing|because)", r"totally", r"real(?:ly)? helpful", r"wow,? (?:thanks|great|just)",
    r"thanks a lot[.!]*$", r"another (?:wall|essay|error|lecture|history lesson|novel)", r"love how you", r"nice try",
    r"very (?:centred|centered|short|brief|concise|helpful|descriptive|original|useful|clear)[.!]",
    r"i'?ll just (?:go )?\w+", r"classic[.!]*$", r"just go",
    r"(?:^|[.!] )(?:brilliant|genius|great|perfect|wonderful|fantastic|amazing|lovely)\.(?= \w)", r"/s",
    r"bravissim[oa]", r"nothing says [\w ]{1,30} like", r"good to know\W*$", r"why didn'?t i think of that")
_HOLD = _words(
    r"wait", r"hold on", r"one sec(?:ond)?", r"a sec", r"a moment", r"a minute", r"brb", r"afk", r"later", r"tomorrow",
    r"next week", r"on monday", r"let me (?:think|check|see|try|look|run|test|compare|ask)",
    r"i'?ll (?:try|test|check|look|see|get back|report|think|ask|come back|add|do)", r"i'?m going to (?:try|test|ask)",
    r"not sure(?: yet)?", r"need to think", r"think (?:it )?over", r"moment bitte", r"später", r"demain", r"mañana",
    r"depois", r"aspetta", r"un momento", r"подожди", r"позже", r"domani", r"morgen",
    r"back in a (?:bit|sec|minute|moment)", r"non sono al (?:pc|computer)", r"jutro", r"yarın")
_CONTRAST = re.compile(
    r"(?<![\w])(?:but|however|though|although|except|apart from|other than|only thing|just one thing|only problem|"
    r"aber|jedoch|mais|cependant|"
    r"pero|sin embargo|però|ma|mas|porém|maar|но|однако|ale|ama)(?![\w])|但是|但|不过|可是|でも|けど|하지만|그런데",
    re.I)
_CONTINUATION = re.compile(r"(?:otherwise|overall|all in all|anyway|in general|apart from that|other than that|"
                           r"still (?:great|good|perfect|helpful|useful)|sonst|ansonsten|sinon|por lo demás|"
                           r"per il resto)\b", re.I)

@dataclass(frozen=True)
class Cues:
    """Counts of cue words in one reply."""

    positive: int
    negative: int
    hold: int
    question: bool
    contrast_negative: bool  # a contrast ("but ...") whose clause after it reads as a complaint
    sarcasm: int  # irony markers ("oh great, ...", "just what I needed")
    chars: int

    @property
    def polarity(self) -> int:
        """+1 / -1 when the cues point one way only; 0 when none or both (a contrast whose
        clause complains counts as -1)."""
        if self.contrast_negative or (self.negative and not self.positive):
            return -1
        return 1 if self.positive and not self.negative and not self.sarcasm else 0


_POS = (_POSITIVE_EN, _POSITIVE_OTHER, _POSITIVE_CJK)
_NEG = (_NEGATIVE_EN, _NEGATIVE_OTHER, _NEGATIVE_CJK)


def _count_positive(text: str) -> int:
    """Positive cues, except one closing a relative clause ("what was great")."""
    return sum(not _RELATIVE.search(text[max(0, m.start() - 24): m.start()]) for p in _POS for m in p.finditer(text))


def _count(pats, text: str) -> int:
    return sum(len(p.findall(text)) for p in pats)


def tail_clause(text: str) -> str:
    """The text after the last contrast word ("thanks, but X" -> "X"), or "" without one. A
    contrast word closing the text ("nice! X is wrong though") marks the sentence it closes."""
    last = None
    for last in _CONTRAST.finditer(text):
        pass
    if not last:
        return ""
    if text[last.end():].strip(" .!?,;"):
        return text[last.end():].strip()
    before = re.split(r"(?<=[.!?])\s+|[,;]\s*", text[: last.start()].strip())
    return before[-1].strip() if len(before) > 1 else ""


def read_cues(text: str) -> Cues:
    """The :class:`Cues` of a user's reply."""
    t = _IGNORE.sub(" ", " ".join((text or "").replace("…", " ").replace("...", " ").split()))
    tail = tail_clause(t)
    if _CONTINUATION.match(tail):  # "but otherwise ...", "but overall ...": the praise stands
        tail = ""
    head = t[: len(t) - len(tail)]
    contrast_negative = bool(tail) and _count_positive(head) > 0 and (_count(_NEG, tail) > 0 or (
        not _count_positive(tail) and not _HOLD.search(tail) and not tail.endswith(("?", "？"))
        and len(tail.split()) >= 3))
    stripped = t.strip()
    return Cues(positive=_count_positive(t), negative=_count(_NEG, t), hold=len(_HOLD.findall(t)),
                question=stripped.endswith(("?", "？")),
                contrast_negative=contrast_negative, sarcasm=len(_SARCASM.findall(t)), chars=len(stripped))


CUE_DIM = 10


def cue_vector(text: str) -> list[float]:
    """The cues as ``CUE_DIM`` floats (counts squashed to [0, 1); flags 0/1), for the classifier head."""
    c = read_cues(text)
    sq = lambda n: n / (n + 1.0)  # noqa: E731  0, 0.5, 0.67, ...
    return [sq(c.positive), sq(c.negative), sq(c.hold), float(c.question), float(c.contrast_negative),
            sq(c.sarcasm), float(c.polarity == 1), float(c.polarity == -1), float(c.question and c.polarity == 0),
            min(c.chars, 400) / 400.0]
